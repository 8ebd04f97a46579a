"""Time and memory: the one timing engine (`engine`), the simulator's timeline
(`timeline`: `simulate` and `Timeline`) and the one activation counter (`memory`)."""
