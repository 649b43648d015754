"""The chat layer under the three API faces (OpenAI's chat completions and Responses, Anthropic's Messages): one
internal request type each face translates its own body into, the rendering through the chat template, the run of a
request's jobs with its text work (stops, thinking, tool calls), and the one streaming loop with its error tail."""
