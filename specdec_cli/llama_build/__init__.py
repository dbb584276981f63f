"""The llama-cpp-python build: install.py (stdlib only, also run as a script by `make`) and the patches it applies."""
