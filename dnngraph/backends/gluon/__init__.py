"""The Gluon backend (triton.experimental.gluon): warp-specialized Hopper matmuls. Opt-in."""
