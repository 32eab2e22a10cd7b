from optc.cli.main import main

main()
