from evaluate.score.rescore import main

main()
