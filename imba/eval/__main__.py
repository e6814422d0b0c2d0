from imba.eval.run import cli

cli()
