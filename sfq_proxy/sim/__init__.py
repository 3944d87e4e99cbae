"""A simulated OpenAI-compatible (vLLM-like) server, for the demo, the lab and the tests."""
