"""One exception type for every problem a user can fix.

Its message is a single line that names the problem and the fix; the CLI prints it without a traceback.
It does not wrap programming errors: those should still crash loudly.
"""


class EdgespecError(Exception):
    """A user-facing error: one line, naming the problem and what to do about it."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))
