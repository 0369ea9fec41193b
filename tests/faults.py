"""Fault doubles for the failure tests and the stress suite."""


class ErrorBuffer:
    """What a device step that failed leaves behind on a GPU: not deleted, but reading it raises."""

    def __init__(self, real):
        self.shape, self.dtype = real.shape, real.dtype

    def is_deleted(self):
        return False

    def block_until_ready(self):
        raise RuntimeError("INTERNAL: the buffer holds an error")
