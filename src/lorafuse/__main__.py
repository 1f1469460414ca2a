from lorafuse.commands import main

raise SystemExit(main())
