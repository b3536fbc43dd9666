# Bad input as the user meets it: a UsageError, which every CLI prints as one `error: ...` line before exiting with
# status 2 and which Python callers catch as a ValueError; the argparse that raises it; an exception's message in one
# line. Standard library only: the models' modules use it as much as the loading code and the commands.
import argparse


class UsageError(ValueError):
    """Bad input: the CLI prints one line and exits with status 2; from Python, a ValueError with that line."""


class UsageParser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of exiting, so every CLI reports bad flags the same way."""

    def error(self, message):
        raise UsageError(message)


def one_line(err: Exception, limit: int = 200) -> str:
    """An exception's message folded into one line: errors reach the user as exactly one line."""
    return " ".join(str(err).split())[:limit] or type(err).__name__
