"""Tool calling: definitions and constraints, model output parsers, tool prompts."""
