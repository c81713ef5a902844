"""Read address 0 with ctypes at import: SIGSEGV."""
import ctypes

ctypes.string_at(0)
