"""kvguard's version (the package's ``__version__``; kept here so that nothing in the
package imports the top-level ``sglang_kvguard`` back)."""

__version__ = "0.1.0"
