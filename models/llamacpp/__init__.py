"""Embedded llama.cpp model backend for rollgym (see engine.py)."""
