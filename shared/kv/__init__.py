"""Where KV lives between prefill and decode: its location registry and the transfer plane that moves it."""
