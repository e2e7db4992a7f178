"""epdserve: disaggregated encoder / prefill / decode LLM serving."""
__version__ = "0.1.0"
