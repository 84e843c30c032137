from edgesplit.cli import main

raise SystemExit(main())
