"""Anthropic's Messages API on a station, above the OpenAI face whose runs it shares."""
