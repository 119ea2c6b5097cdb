"""Tool calls: `tools` / `tool_choice` into the prompt and the output constraint (choice.py), and the model's
text back into `tool_calls`, whole or streamed, by one parser per template family (hermes.py: Qwen / Hermes
`<tool_call>{...}</tool_call>`; llama3_json.py: Llama 3.1's bare JSON), chosen by settings.tool_call_parser or
from the chat template (registry.py); their interface and shared helpers: parsers.py."""
