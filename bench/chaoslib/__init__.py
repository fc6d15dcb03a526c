"""The chaos harness's parts (bench/chaos.py is its entry point; docs/chaos.md)."""
