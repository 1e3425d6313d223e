from .cli import exporter_main

exporter_main()
