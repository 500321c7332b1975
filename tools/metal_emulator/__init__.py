"""The CPU emulator of the Metal kernels (:mod:`.emulate`): CI's check of the shipped
shader source off-Mac.  Kept out of the wheel; tests import it as ``metal_emulator``
(pytest puts ``tools/`` on ``sys.path``)."""
