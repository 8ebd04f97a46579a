"""The cluster a plan runs on: devices, their memory, and the link between every pair.

Read from YAML (`pipelang plan --topology T.yaml`) in one of two forms. The full form
lists the devices and the links:

    devices:
      - {name: a, memory: 80GiB, kind: H100, speed: 2}   # `kind`, `speed`: optional
      - {name: b, memory: 80GiB, kind: A100}
    links:
      - {between: [a, b], bandwidth: 300GB/s, latency: 2us}
    default_link: {bandwidth: 25GB/s, latency: 10us}

Links come in classes. A device may name its `node` and its `datacenter`; a pair not
listed under `links` then takes `intra_node` (one node), `inter_node` (two nodes of one
datacenter, or of no named one) or `inter_datacenter` (two datacenters), each given at
the top level, and `default_link` when its class is not given or the devices name no
node. `link_classes` names links that any link may then name instead of spelling
them out (`intra_node: nvlink`, `{between: [a, b], class: nvlink}`).

The shorthand is N nodes of G GPUs each, one link inside a node and one between nodes;
the devices are named `node0.gpu0`, `node0.gpu1`, ..., node by node:

    nodes: 2
    gpus_per_node: 4
    memory: 80GiB
    intra_node: {bandwidth: 300GB/s, latency: 2us}     # NVLink
    inter_node: {bandwidth: 25GB/s, latency: 10us}     # the network
    kind: H100                                         # optional
    datacenters: 2                                     # optional: nodes split evenly
    inter_datacenter: {bandwidth: 1GB/s, latency: 20ms}  # needed with datacenters > 1

`nodes` may also be a list of classes of nodes, each `{count, gpus_per_node, memory,
kind, speed, datacenter}` (all but `count` optional where the top level gives them; a
class without `datacenter` is in no named one); the nodes are numbered class by class.

The shorthand takes `link_classes` too. A device's `kind` names what it is; `pipelang
plan` notes a profile measured on another kind (the layer times would not hold there).
Its `speed` (default 1) is how many times faster than the profiled device it runs the
layers: the partition gives it more.

Every problem is E0402 and points at the line of the YAML file that causes it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml

from pipelang.diagnostics import PipelangError, fail, listing
from pipelang.planner.units import (
    parse_bandwidth,
    parse_bytes,
    parse_seconds,
    parse_speed,
    positive,
)
from pipelang.readers import ReadError, read_source, whole_number
from pipelang.source import SourceFile, Span

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Link:
    """A connection between two devices: bytes per second, and seconds per message."""

    bandwidth: float
    latency: float

    def seconds(self, size: float) -> float:
        """The time to move `size` bytes over this link (latency plus size/bandwidth)."""
        return self.latency + size / self.bandwidth


@dataclass(frozen=True, slots=True)
class Topology:
    """Devices (names and memory in bytes) and `links[a][b]` between every pair."""

    names: tuple[str, ...]
    memory: tuple[float, ...]
    links: tuple[tuple[Link | None, ...], ...]
    kinds: tuple[str, ...] = ()
    """Each device's kind as the file names it (`H100`, `cpu`; "" when not given), or
    empty: what `pipelang plan` compares with the profile's device."""
    speeds: tuple[float, ...] = ()
    """Each device's speed relative to the profiled device (its layers take 1/speed of
    the profile's time), or empty: all 1."""

    @property
    def size(self) -> int:
        return len(self.names)

    def link(self, a: int, b: int) -> Link:
        """The link between devices `a` and `b` (distinct)."""
        found = self.links[a][b]
        assert found is not None, (a, b)
        return found

    def first(self, count: int) -> Topology:
        """The first `count` devices and the links between them."""
        return Topology(
            self.names[:count],
            self.memory[:count],
            tuple(row[:count] for row in self.links[:count]),
            self.kinds[:count],
            self.speeds[:count],
        )

    def speed_of(self, device: int) -> float:
        """The device's speed relative to the profiled one (1 when the file does not say)."""
        return self.speeds[device] if self.speeds else 1.0

    def kind_of(self, device: int) -> str:
        """The device's kind, "" when the file does not say."""
        return self.kinds[device] if self.kinds else ""


def load_topology(path: Path) -> Topology:
    """Read and check a topology YAML file; every problem is E0402."""
    return parse_topology(read_source(path, "E0402"))


def parse_topology(source: SourceFile) -> Topology:
    """The Topology a YAML text describes (see the module docstring)."""
    try:
        root = yaml.compose(source.text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise fail("E0402", f"the topology `{source.path}` nests too deep") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        span = _span_at(source, mark.index) if mark is not None else None
        problem = getattr(err, "problem", None) or str(err)
        raise fail("E0402", f"the topology is not valid YAML: {problem}", span) from None
    reader = _Reader(source)
    if root is None:
        raise fail("E0402", f"the topology `{source.path}` is empty", help=reader.HELP)
    if not isinstance(root, yaml.MappingNode):
        raise reader.error("a topology is a mapping: `devices:` ... or `nodes:` ...", root)
    keys = reader.mapping(root)
    if "link_classes" in keys:
        reader.read_classes(keys["link_classes"])
    if "nodes" in keys:
        return _shorthand(reader, root, keys)
    if "devices" in keys:
        return _full(reader, root, keys)
    raise reader.error(
        "a topology needs `devices` (with `links`) or the shorthand `nodes` and `gpus_per_node`",
        root,
    )


MAX_DEVICES = 4096
"""The most devices a topology lists (checked before any per-device work)."""

_LINK_KEYS = {"bandwidth", "latency"}
_CLASSES = ("intra_node", "inter_node", "inter_datacenter")
_NODE_KEYS = ("gpus_per_node", "memory", "kind", "speed")
"""What a class of nodes gives, or takes from the shorthand's top level."""
_MEMORY = positive(parse_bytes, "a device's memory")


def _shorthand(reader: _Reader, root: yaml.MappingNode, keys: dict[str, yaml.Node]) -> Topology:
    reader.only(
        root,
        {
            "nodes",
            "gpus_per_node",
            "memory",
            "intra_node",
            "inter_node",
            "kind",
            "speed",
            "datacenters",
            "inter_datacenter",
            "link_classes",
        },
    )
    spec = keys["nodes"]
    groups = _node_groups(reader, root, keys)
    size = sum(count * gpus for count, gpus, *_ in groups)
    if size > MAX_DEVICES:
        raise reader.error(f"{size:,} devices; the planner takes at most {MAX_DEVICES}", spec)
    site_of: list[str | None] = []  # per node
    node_of: list[int] = []  # per device
    memory: list[float] = []
    kinds: list[str] = []
    speeds: list[float | None] = []
    for count, gpus, capacity, kind, speed, site in groups:
        for _ in range(count):
            site_of.append(site)
            node_of.extend([len(site_of) - 1] * gpus)
            memory.extend([capacity] * gpus)
            kinds.extend([kind] * gpus)
            speeds.extend([speed] * gpus)
    per_site = Counter(site_of)
    intra = reader.link(reader.need(keys, "intra_node", root)) if size > len(site_of) else None
    inter = (
        reader.link(reader.need(keys, "inter_node", root)) if max(per_site.values()) > 1 else None
    )
    far = reader.link(reader.need(keys, "inter_datacenter", root)) if len(per_site) > 1 else None
    names, gpu = [], Counter[int]()
    for node in node_of:
        names.append(f"node{node}.gpu{gpu[node]}")
        gpu[node] += 1

    def between(a: int, b: int) -> Link | None:
        p, q = node_of[a], node_of[b]
        if p == q:
            return intra
        return inter if site_of[p] == site_of[q] else far

    links = tuple(map(tuple, _table(node_of, between)))
    given = any(s is not None for s in speeds)
    return Topology(
        tuple(names),
        tuple(memory),
        links,
        tuple(kinds) if any(kinds) else (),
        tuple(1.0 if s is None else s for s in speeds) if given else (),
    )


NodeClass = tuple[int, int, float, str, "float | None", "str | None"]
"""(nodes, GPUs per node, memory, kind, speed or None, datacenter or None)."""


def _node_groups(
    reader: _Reader, root: yaml.MappingNode, keys: dict[str, yaml.Node]
) -> list[NodeClass]:
    """The shorthand's nodes as classes of like nodes: each listed class, or `nodes`
    split evenly over `datacenters`."""
    spec = keys["nodes"]
    if isinstance(spec, yaml.SequenceNode):
        if "datacenters" in keys:
            raise reader.error(
                "with classes of nodes, each class names its `datacenter`; `datacenters` "
                "splits a number of nodes",
                keys["datacenters"],
            )
        groups = []
        for item in _items(reader, spec, "nodes"):
            entry = reader.mapping(item)
            reader.only(item, {"count", *_NODE_KEYS, "datacenter"})
            defaults = {key: keys[key] for key in _NODE_KEYS if key in keys}
            count = reader.count(entry, "count", item)
            groups.append(_node_class(reader, item, {**defaults, **entry}, count))
        if not groups:
            raise reader.error("`nodes` is a number, or a non-empty list of node classes", spec)
        return groups
    nodes = reader.count(keys, "nodes", root)
    sites = reader.count(keys, "datacenters", root) if "datacenters" in keys else 1
    if nodes % sites:
        raise reader.error(
            f"{nodes} nodes do not split evenly over {sites} datacenters", keys["datacenters"]
        )
    _, gpus, capacity, kind, speed, _ = _node_class(reader, root, keys, nodes // sites)
    return [
        (nodes // sites, gpus, capacity, kind, speed, str(site) if sites > 1 else None)
        for site in range(sites)
    ]


def _node_class(
    reader: _Reader, node: yaml.Node, keys: dict[str, yaml.Node], count: int
) -> NodeClass:
    """`count` nodes whose `gpus_per_node`, `memory` and optional `kind`, `speed` and
    `datacenter` are in `keys` (errors point into `node`)."""
    gpus = reader.count(keys, "gpus_per_node", node)
    memory = reader.value(reader.need(keys, "memory", node), _MEMORY)
    kind = reader.text(keys["kind"]) if "kind" in keys else ""
    speed = reader.value(keys["speed"], parse_speed) if "speed" in keys else None
    site = reader.text(keys["datacenter"]) if "datacenter" in keys else None
    return count, gpus, memory, kind, speed, site


def _full(reader: _Reader, root: yaml.MappingNode, keys: dict[str, yaml.Node]) -> Topology:
    reader.only(root, {"devices", "links", "default_link", "link_classes", *_CLASSES})
    devices = keys["devices"]
    if not isinstance(devices, yaml.SequenceNode) or not devices.value:
        raise reader.error("`devices` is a non-empty list of {name, memory}", devices)
    if len(devices.value) > MAX_DEVICES:
        raise reader.error(
            f"{len(devices.value):,} devices; the planner takes at most {MAX_DEVICES}", devices
        )
    names: list[str] = []
    index: dict[str, int] = {}
    memory: list[float] = []
    kinds: list[str] = []
    speeds: list[float] = []
    places: list[tuple[str | None, str | None]] = []  # (node, datacenter)
    for node in devices.value:
        if not isinstance(node, yaml.MappingNode):
            raise reader.error("a device is a mapping {name: ..., memory: ...}", node)
        entry = reader.mapping(node)
        reader.only(node, {"name", "memory", "kind", "speed", "node", "datacenter"})
        kinds.append(reader.text(entry["kind"]) if "kind" in entry else "")
        places.append(
            (
                reader.text(entry["node"]) if "node" in entry else None,
                reader.text(entry["datacenter"]) if "datacenter" in entry else None,
            )
        )
        speeds.append(reader.value(entry["speed"], parse_speed) if "speed" in entry else 1.0)
        name = reader.text(reader.need(entry, "name", node))
        if name in index:
            raise reader.error(f"device `{name}` is listed twice", entry["name"])
        index[name] = len(names)
        names.append(name)
        memory.append(reader.value(reader.need(entry, "memory", node), _MEMORY))
    size = len(names)
    listed: list[tuple[int, int, Link]] = []
    for node in _items(reader, keys.get("links"), "links"):
        entry = reader.mapping(node)
        reader.only(node, {"between", "class", *_LINK_KEYS})
        pair = reader.need(entry, "between", node)
        ends = pair.value if isinstance(pair, yaml.SequenceNode) else []
        if len(ends) != 2:
            raise reader.error("`between` names two devices: [a, b]", pair)
        a, b = (_device(reader, index, end) for end in ends)
        if a == b:
            raise reader.error("a link joins two different devices", pair)
        listed.append((a, b, reader.link(node, entry)))
    default = keys.get("default_link")
    fallback = reader.link(default) if default is not None else None
    classes = {name: reader.link(keys[name]) for name in _CLASSES if name in keys}

    def by_class(a: int, b: int) -> Link | None:
        kind = _class_of(places[a], places[b])
        return classes.get(kind, fallback) if kind is not None else fallback

    table = _table(places, by_class)
    for a, b, link in listed:
        table[a][b] = table[b][a] = link
    for a in range(size):
        if table[a].count(None) > 1:
            b = next(b for b, link in enumerate(table[a]) if link is None and b != a)
            kind = _class_of(places[a], places[b])
            where = f"`{kind}` or " if kind is not None else ""
            raise reader.error(
                f"no link between `{names[a]}` and `{names[b]}`"
                + (f" ({_CLASS_TEXT[kind]})" if kind is not None else "")
                + f"; give {where}a `default_link`, or list the pair under `links`",
                root,
            )
    links = tuple(tuple(row) for row in table)
    return Topology(
        tuple(names),
        tuple(memory),
        links,
        tuple(kinds) if any(kinds) else (),
        tuple(speeds) if any(s != 1.0 for s in speeds) else (),
    )


P = TypeVar("P")


def _table(
    place_of: Sequence[P], link: Callable[[int, int], Link | None]
) -> list[list[Link | None]]:
    """The link between every two devices, None on the diagonal, where `link(a, b)`
    depends only on the places (a node, say) of `a` and `b` when `a != b`: it is asked
    once per place and device, and the row of a place copied to each of its devices, so
    that 4096 devices take a second, not a minute."""
    size = len(place_of)
    rows: dict[P, tuple[int, list[Link | None]]] = {}
    table: list[list[Link | None]] = []
    for a in range(size):
        if place_of[a] not in rows:
            rows[place_of[a]] = (a, [None if a == b else link(a, b) for b in range(size)])
        first, row = rows[place_of[a]]
        table.append(list(row))
        if first != a:
            table[a][first] = link(a, first)
        table[a][a] = None
    return table


_CLASS_TEXT = {
    "intra_node": "one node",
    "inter_node": "two nodes of one datacenter",
    "inter_datacenter": "two datacenters",
}


def _class_of(a: tuple[str | None, str | None], b: tuple[str | None, str | None]) -> str | None:
    """The link class of two devices' (node, datacenter): None unless both name a node."""
    if a[0] is None or b[0] is None:
        return None
    if a[1] is not None and b[1] is not None and a[1] != b[1]:
        return "inter_datacenter"
    return "intra_node" if a[0] == b[0] and a[1] == b[1] else "inter_node"


def _items(reader: _Reader, node: yaml.Node | None, key: str) -> list[yaml.MappingNode]:
    if node is None:
        return []
    if not isinstance(node, yaml.SequenceNode):
        raise reader.error(f"`{key}` is a list", node)
    for item in node.value:
        if not isinstance(item, yaml.MappingNode):
            raise reader.error(f"an entry of `{key}` is a mapping", item)
    return list(node.value)


def _device(reader: _Reader, index: dict[str, int], node: yaml.Node) -> int:
    name = reader.text(node)
    if name not in index:
        raise reader.error(f"no device named `{name}`; devices are {listing(list(index))}", node)
    return index[name]


def _span_at(source: SourceFile, index: int) -> Span:
    return Span(source, index, min(index + 1, len(source.text)))


class _Reader:
    """Reads YAML nodes into values; every error points at the node's text."""

    HELP = "see docs/planner.md"

    def __init__(self, source: SourceFile) -> None:
        self.source = source
        self.classes: dict[str, Link] = {}
        """The file's `link_classes`, by name."""

    def read_classes(self, node: yaml.Node) -> None:
        if not isinstance(node, yaml.MappingNode):
            raise self.error("`link_classes` maps names to links {bandwidth, latency}", node)
        for name, value in self.mapping(node).items():
            if not isinstance(value, yaml.MappingNode):
                raise self.error(f"link class `{name}` is a mapping {{bandwidth, latency}}", value)
            self.classes[name] = self.link(value)

    def error(self, message: str, node: yaml.Node) -> PipelangError:
        start, end = node.start_mark.index, node.end_mark.index
        if end <= start:
            end = start + 1
        # A block mapping ends where the next one starts: show its first line only.
        line_end = self.source.text.find("\n", start)
        if line_end >= 0:
            end = min(end, max(line_end, start + 1))
        return fail("E0402", message, Span(self.source, start, end), help=self.HELP)

    def mapping(self, node: yaml.MappingNode) -> dict[str, yaml.Node]:
        found: dict[str, yaml.Node] = {}
        for key, value in node.value:
            name = self.text(key)
            if name in found:
                raise self.error(f"`{name}` is given twice", key)
            found[name] = value
        return found

    def only(self, node: yaml.MappingNode, allowed: set[str]) -> None:
        """Refuse a key of mapping `node` outside `allowed`, pointing at the key."""
        for key, _ in node.value:
            if self.text(key) not in allowed:
                raise self.error(
                    f"unknown key `{key.value}`; expected {', '.join(sorted(allowed))}", key
                )

    def need(self, keys: dict[str, yaml.Node], key: str, node: yaml.Node) -> yaml.Node:
        if key not in keys:
            raise self.error(f"missing `{key}`", node)
        return keys[key]

    def text(self, node: yaml.Node) -> str:
        if not isinstance(node, yaml.ScalarNode):
            raise self.error("expected a plain value here", node)
        return str(node.value)

    def value(self, node: yaml.Node, parse: Callable[[object], T]) -> T:
        try:
            return parse(self.text(node))
        except ReadError as err:
            raise self.error(str(err), node) from None

    def count(self, keys: dict[str, yaml.Node], key: str, node: yaml.Node) -> int:
        text = self.text(self.need(keys, key, node))
        try:
            return whole_number(text, 1, MAX_DEVICES, f"`{key}`")
        except ReadError as err:
            raise self.error(str(err), keys[key]) from None

    def link(self, node: yaml.Node, entry: dict[str, yaml.Node] | None = None) -> Link:
        """A link: a mapping {bandwidth, latency}, or the name of a link class (as a
        plain value, or a `links` entry's `class`)."""
        if entry is None and isinstance(node, yaml.ScalarNode):
            return self.named(node)
        if entry is None:
            if not isinstance(node, yaml.MappingNode):
                raise self.error("a link is a mapping {bandwidth: ..., latency: ...}", node)
            entry = self.mapping(node)
            self.only(node, _LINK_KEYS)
        if "class" in entry:
            if _LINK_KEYS & entry.keys():
                raise self.error("a link names a `class` or gives its bandwidth, not both", node)
            return self.named(entry["class"])
        bandwidth = self.value(self.need(entry, "bandwidth", node), parse_bandwidth)
        latency = self.value(entry["latency"], parse_seconds) if "latency" in entry else 0.0
        return Link(bandwidth, latency)

    def named(self, node: yaml.Node) -> Link:
        name = self.text(node)
        if name not in self.classes:
            known = ", ".join(self.classes) if self.classes else "none (no `link_classes`)"
            raise self.error(f"unknown link class `{name}`; the classes are {known}", node)
        return self.classes[name]
