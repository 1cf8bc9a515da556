"""Errors a user can cause. The CLI prints them as one line and exits 2; the TUI shows them in
place. Anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input: the message names the input, the problem and the fix."""

    exit_code = 2


class MeasurementError(UserError):
    """A measurement that would be a lie (zero tokens, zero time, a non-finite rate): refused."""
