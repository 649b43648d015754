"""The OpenAI face of a station: `/v1/completions`, `/v1/chat/completions`, `/v1/responses`, `/v1/models` and vLLM's
tokenizer routes, declared as pydantic models in `protocol` and `responses_protocol`, translated onto the chat layer
(`jaxstation.chat`)."""
