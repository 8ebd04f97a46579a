"""pipelang: a language and compiler for pipeline-parallel training schedules."""

__version__ = "0.1.0"
