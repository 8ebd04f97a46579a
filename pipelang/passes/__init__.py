"""The compiler passes, one module each; `pipelang.compiler.PASSES` lists them in order."""
