"""The search environment: protocol, action parsing, retrievers."""
