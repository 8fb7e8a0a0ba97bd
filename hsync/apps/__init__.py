"""Programs built on the library, apart from it: the BERT application (bert/) and what the example
programs share (cli.py). `import hsync` imports none of it."""
