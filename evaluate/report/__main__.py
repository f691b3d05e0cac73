from evaluate.report.cli import main

main()
