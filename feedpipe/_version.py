"""The version, written once: the package, its metadata and every report read it here."""

__version__ = "0.3.0"
