"""The C++ form of the eager training layer (train.cpp, built on first use by build.py)."""
