"""Tests of the transformers model server (the bundled SmolLM2-135M on CPU, real HTTP)."""
