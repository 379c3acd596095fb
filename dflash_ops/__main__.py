from dflash_ops.cli import main

main()
