"""megapar: 3D-parallel (tensor / pipeline / data) transformer training that gives the same numbers in any layout."""

__version__ = "0.1.0"
