"""relaunch: make a rented cloud GPU disposable."""

__version__ = "0.1.0"
