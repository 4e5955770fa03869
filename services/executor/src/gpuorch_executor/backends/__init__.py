"""Launch backends behind one interface (``backends.base.Backend``): ``process`` and ``container``."""
