"""The terminal chat of edgespec (`edgespec chat`), built on Textual.

Keys: Enter sends, Shift+Enter (or Ctrl+J) adds a line, Up/Down on the first/last line walk earlier prompts,
Escape stops the answer, Ctrl+N starts a new chat, F2/Ctrl+T toggles colouring by origin (off = Markdown),
F3/Ctrl+S toggles speculation (the A/B behind "speedup vs plain"), F4 opens the settings, Ctrl+Q quits.

`tui` imports `edgespec`, never the reverse: the CLI imports this package lazily inside `cmd_chat`.
Nothing here loads models; the app gets an `edgespec.api.Model` from a factory it is given and talks to it
through the Python API alone (`Model.chat`).
"""
