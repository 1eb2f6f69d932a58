"""TokenSpeed appliance: an OpenAI-compatible LLM server with TokenSpeed's parameters."""

__version__ = "0.1.0"
