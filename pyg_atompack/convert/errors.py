"""The one exception family of the conversion layer."""

from __future__ import annotations

import os


class ConvertError(ValueError):
    """A source or destination that cannot be converted.

    The message always names the file (and, where it applies, the structure
    index and the field) so that the command line can print it as one line.

    Args:
        path (str | os.PathLike): The file or directory the problem is about.
        problem (str): What is wrong, in words.
        index (int, optional): The structure index inside the source, when known.
            (default: :obj:`None`)
    """

    def __init__(self, path: str | os.PathLike, problem: str, index: int | None = None) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        self.index = index
        where = self.path if index is None else f"{self.path} (structure {index})"
        super().__init__(f"{where}: {problem}")


class ConversionNote(UserWarning):
    """Something a conversion did on the user's behalf that they should know about.

    Type promotions, a target taken as the energy, ``force`` renamed ``forces``:
    the data is kept, but not exactly as named or typed in the source. The
    command line prints each note once on stderr.
    """


def note(message: str) -> None:
    """Tell the user about a :class:`ConversionNote` (once per message).

    Args:
        message (str): The note, naming the file and the key it is about.
    """
    import warnings

    warnings.warn(message, ConversionNote, stacklevel=2)
