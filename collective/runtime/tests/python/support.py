"""Helpers shared by the test scripts here (not a test itself: tests/python.rs runs the scripts it names)."""


class OnlyDLPack:
    """Hides numpy behind the DLPack protocol, like a framework tensor."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()
