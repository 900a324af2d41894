"""Errors that reach the user as one clear line (the CLI prints them and exits 2)."""


class FlashgenError(Exception):
    """A problem with the user's input or files, stated so that the user can fix it."""
