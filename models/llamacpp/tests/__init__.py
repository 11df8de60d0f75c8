"""Tests for the embedded llama.cpp engine (real model, no mocks)."""
