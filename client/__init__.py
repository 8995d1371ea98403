"""Client: fires conversations at an SGLang server as tagged capture requests."""
