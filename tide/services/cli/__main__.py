from tide.services.cli.main import main

main()
