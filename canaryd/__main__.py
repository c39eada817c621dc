from canaryd.cli import main

main()
