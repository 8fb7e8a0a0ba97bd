"""What the example programs are built from, apart from the library: the BERT application (bert/), the
examples' command line (cli.py) and their labelled data (labelled.py). The programs beside this folder
import it as `apps` (Python puts a script's own folder first on its path); the tests, through pytest's
`pythonpath`. It is not part of the hsync package."""
