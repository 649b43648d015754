"""Anthropic's Messages API on a station: its protocol, and its translation onto the chat layer (`jaxstation.chat`)
that the OpenAI faces share."""
