"""Old import paths kept working (with a DeprecationWarning): ``compat.msprobe``."""
