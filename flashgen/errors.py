"""Errors that reach the user as one clear line (the CLI prints them and exits 2)."""


class FlashgenError(Exception):
    """A problem with the user's input or files, stated so that the user can fix it."""


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its text."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def reason(e: BaseException) -> str:
    """Why something failed, in one line: a FlashgenError's own text (it is written for the user), else
    `one_line`."""
    return str(e) if isinstance(e, FlashgenError) and str(e).strip() else one_line(e)
