"""ttile's version, in a module of its own so that any layer can read it without
importing the package's API (which would make an import cycle)."""
__version__ = "0.1.0"
