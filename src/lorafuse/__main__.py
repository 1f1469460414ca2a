from lorafuse.cli import main

raise SystemExit(main())
