"""Imported only through fastspawn's preload, so a test can see it happened."""

LOADED = True
