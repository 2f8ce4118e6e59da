from preflight.launcher import main

main()
