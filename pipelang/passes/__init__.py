"""The compiler passes, one module each; `pipelang.compiler.passes()` lists them in order."""
