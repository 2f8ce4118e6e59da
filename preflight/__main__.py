from preflight.cli.start import main

main()
